'use strict';
// For a JavaScript block tagged "run serve=PATH" (test/docs.sh): the
// server the block starts listens on a free port instead of the one it
// names, and is sent the same POST to PATH twice, with one Idempotency-Key.
// The first answer must be a 2xx, the second the same status and body with
// Idempotent-Replayed: true.  Exits 0 if so, 1 otherwise.
const http = require('node:http');

const path = process.env.IDEM_DOCS_SERVE;
const listen = http.Server.prototype.listen;

function post(port) {
  return new Promise((resolve, reject) => {
    const body = '{"sku":"A","qty":1}';
    const req = http.request({ host: '127.0.0.1', port, path, method: 'POST', headers: {
      'Content-Type': 'application/json', 'Content-Length': Buffer.byteLength(body),
      'Idempotency-Key': 'docs-serve-1' } }, (res) => {
      const chunks = [];
      res.on('data', (c) => chunks.push(c));
      res.on('end', () => resolve({ status: res.statusCode, headers: res.headers,
        body: Buffer.concat(chunks).toString() }));
    });
    req.on('error', reject);
    req.end(body);
  });
}

http.Server.prototype.listen = function () {
  const server = this;
  server.once('listening', async () => {
    try {
      const { port } = server.address();
      const first = await post(port);
      const second = await post(port);
      const fail = (what) => { throw new Error(`${what}: ${JSON.stringify({ first, second })}`); };
      if (first.status < 200 || first.status > 299) fail('first answer not 2xx');
      if (first.headers['idempotent-replayed']) fail('first answer marked as a replay');
      if (second.status !== first.status || second.body !== first.body) fail('replay differs');
      if (second.headers['idempotent-replayed'] !== 'true') fail('replay not marked');
      console.log(`POST ${path} twice: ${first.status}, then the replay`);
      process.exit(0);
    } catch (e) {
      console.error(e);
      process.exit(1);
    }
  });
  return listen.call(server, 0, '127.0.0.1');
};
