/*-------------------------------------------------------------------------
 *
 * sha256.c
 *	  SHA-256 (FIPS 180-4) of a fingerprint, for the hot path.
 *
 * PostgreSQL's cryptohash API goes through OpenSSL's EVP layer, whose
 * per-call context set-up costs several times the hash of a short
 * fingerprint.  This one-shot version needs no allocation.  The regression
 * tests compare its digests with PostgreSQL's sha256().
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "sha256.h"

static const uint32 sha256_k[64] = {
	0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1,
	0x923f82a4, 0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3,
	0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786,
	0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
	0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147,
	0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13,
	0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
	0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
	0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a,
	0x5b9cca4f, 0x682e6ff3, 0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208,
	0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2
};

#define ROTR(x, n)	(((x) >> (n)) | ((x) << (32 - (n))))

/* Fold one 64-byte block into the state. */
static void
sha256_block(uint32 *state, const uint8 *block)
{
	uint32		w[64];
	uint32		a, b, c, d, e, f, g, h;
	int			i;

	for (i = 0; i < 16; i++)
		w[i] = ((uint32) block[i * 4] << 24) | ((uint32) block[i * 4 + 1] << 16) |
			((uint32) block[i * 4 + 2] << 8) | (uint32) block[i * 4 + 3];
	for (i = 16; i < 64; i++)
	{
		uint32		s0 = ROTR(w[i - 15], 7) ^ ROTR(w[i - 15], 18) ^ (w[i - 15] >> 3);
		uint32		s1 = ROTR(w[i - 2], 17) ^ ROTR(w[i - 2], 19) ^ (w[i - 2] >> 10);

		w[i] = w[i - 16] + s0 + w[i - 7] + s1;
	}

	a = state[0];
	b = state[1];
	c = state[2];
	d = state[3];
	e = state[4];
	f = state[5];
	g = state[6];
	h = state[7];
	for (i = 0; i < 64; i++)
	{
		uint32		t1 = h + (ROTR(e, 6) ^ ROTR(e, 11) ^ ROTR(e, 25)) +
			((e & f) ^ (~e & g)) + sha256_k[i] + w[i];
		uint32		t2 = (ROTR(a, 2) ^ ROTR(a, 13) ^ ROTR(a, 22)) +
			((a & b) ^ (a & c) ^ (b & c));

		h = g;
		g = f;
		f = e;
		e = d + t1;
		d = c;
		c = b;
		b = a;
		a = t1 + t2;
	}
	state[0] += a;
	state[1] += b;
	state[2] += c;
	state[3] += d;
	state[4] += e;
	state[5] += f;
	state[6] += g;
	state[7] += h;
}

/* SHA-256 of data[0 .. len-1] into out[IDEM_FINGERPRINT_LEN]. */
void
idem_sha256(const uint8 *data, size_t len, uint8 *out)
{
	uint32		state[8] = {
		0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
		0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19
	};
	uint8		tail[128];
	size_t		full = len & ~(size_t) 63;
	size_t		rest = len - full;
	size_t		tail_len = (rest < 56) ? 64 : 128;
	uint64		bits = (uint64) len * 8;
	size_t		i;

	for (i = 0; i < full; i += 64)
		sha256_block(state, data + i);

	/* Last bytes, the 0x80 marker, zero padding and the bit length. */
	memset(tail, 0, sizeof(tail));
	memcpy(tail, data + full, rest);
	tail[rest] = 0x80;
	for (i = 0; i < 8; i++)
		tail[tail_len - 1 - i] = (uint8) (bits >> (i * 8));
	sha256_block(state, tail);
	if (tail_len == 128)
		sha256_block(state, tail + 64);

	for (i = 0; i < 8; i++)
	{
		out[i * 4] = (uint8) (state[i] >> 24);
		out[i * 4 + 1] = (uint8) (state[i] >> 16);
		out[i * 4 + 2] = (uint8) (state[i] >> 8);
		out[i * 4 + 3] = (uint8) state[i];
	}
}
