/*
 * sha256_check: src/sha256.c against FIPS 180-4's examples, on both of
 * its paths: the portable rounds (built with IDEM_SHA256_PORTABLE, as
 * idem_sha256_portable) and the path the processor gets (the SHA
 * extensions where it has them), and the two against each other for every
 * length from 0 to 1000 bytes.  The regression tests compare the path the
 * server takes with PostgreSQL's sha256(); this covers the other.
 * Prints "ok NAME" or "not ok NAME" per check; exits 1 if one failed.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern void idem_sha256(const unsigned char *data, size_t len, unsigned char *out);
extern void idem_sha256_portable(const unsigned char *data, size_t len, unsigned char *out);

static const struct
{
	const char *msg;
	size_t		repeat;
	const char *hex;
} vectors[] = {
	{"abc", 1, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"},
	{"", 1, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"},
	{"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq", 1,
	"248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"},
	{"abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmnoijklmnopjklmnopqklmnopqrlmnopqrsmnopqrstnopqrstu", 1,
	"cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1"},
	{"a", 1000000, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0"},
};

static int	failed = 0;

static void
check(int good, const char *name, size_t n)
{
	printf("%s %s %zu\n", good ? "ok" : "not ok", name, n);
	if (!good)
		failed++;
}

static void
hex(const unsigned char *d, char *out)
{
	int			i;

	for (i = 0; i < 32; i++)
		sprintf(out + i * 2, "%02x", d[i]);
}

int
main(void)
{
	unsigned char *buf = malloc(1000000);
	unsigned char a[32], b[32];
	char		h[65];
	size_t		i, n;
	unsigned	x = 12345;

	for (i = 0; i < sizeof(vectors) / sizeof(vectors[0]); i++)
	{
		size_t		len = strlen(vectors[i].msg);

		for (n = 0; n < vectors[i].repeat; n++)
			memcpy(buf + n * len, vectors[i].msg, len);
		idem_sha256_portable(buf, len * vectors[i].repeat, a);
		hex(a, h);
		check(strcmp(h, vectors[i].hex) == 0, "FIPS 180-4 example, portable", i + 1);
		idem_sha256(buf, len * vectors[i].repeat, b);
		hex(b, h);
		check(strcmp(h, vectors[i].hex) == 0, "FIPS 180-4 example, this processor's path", i + 1);
	}
	for (i = 0; i < 1000; i++)
	{
		x = x * 1103515245 + 12345;
		buf[i] = (unsigned char) (x >> 16);
	}
	for (n = 0; n <= 1000; n++)
	{
		idem_sha256_portable(buf, n, a);
		idem_sha256(buf, n, b);
		if (memcmp(a, b, 32) != 0)
			check(0, "portable and this processor's path agree, length", n);
	}
	check(failed == 0, "portable and this processor's path agree on lengths 0 to", 1000);
	free(buf);
	return failed ? 1 : 0;
}
