/*-------------------------------------------------------------------------
 *
 * sha256.c
 *	  SHA-256 (FIPS 180-4) of a fingerprint, for the hot path.
 *
 * PostgreSQL's cryptohash API goes through OpenSSL's EVP layer, whose
 * per-call context set-up costs several times the hash of a short
 * fingerprint.  This one-shot version needs no allocation.  On x86-64
 * processors with the SHA extensions (Intel since Goldmont and Ice Lake,
 * AMD since Zen) the blocks are compressed with their instructions,
 * chosen once per process by CPUID; elsewhere, and under valgrind, which
 * does not report the extensions, by the portable code.  The regression
 * tests compare the digests with PostgreSQL's sha256() for every length
 * from 0 to 200 bytes, so stored fingerprints match across versions.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "port/pg_bswap.h"

#include "sha256.h"

/* IDEM_SHA256_PORTABLE builds the portable path only (test/sha256). */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && \
	!defined(IDEM_SHA256_PORTABLE)
#define IDEM_SHA256_SHANI 1
#include <cpuid.h>
#include <immintrin.h>
#endif

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

/*
 * FIPS 180-4's functions.  The sigmas rotate a value already rotated
 * (rotr(rotr(rotr(x, 9) ^ x, 11) ^ x, 2) is rotr(x, 2) ^ rotr(x, 13) ^
 * rotr(x, 22)), which x86-64's two-operand rotate does without a copy of
 * x per rotation: about 8% fewer instructions per block.
 */
#define ROTR(x, n)	(((x) >> (n)) | ((x) << (32 - (n))))
#define CH(x, y, z)	((z) ^ ((x) & ((y) ^ (z))))
#define BSIG0(x)	ROTR(ROTR(ROTR(x, 9) ^ (x), 11) ^ (x), 2)
#define BSIG1(x)	ROTR(ROTR(ROTR(x, 14) ^ (x), 5) ^ (x), 6)
#define SSIG0(x)	(ROTR(ROTR(x, 11) ^ (x), 7) ^ ((x) >> 3))
#define SSIG1(x)	(ROTR(ROTR(x, 2) ^ (x), 17) ^ ((x) >> 10))

/*
 * One round.  Instead of moving the eight working variables along after
 * each round, the callers rename them: round i + 1 passes (h, a, ..., g)
 * where round i passed (a, b, ..., h).  Maj(a, b, c) is ((a ^ b) & (b ^ c))
 * ^ b, and this round's a ^ b is the next round's b ^ c, carried in bc.
 */
#define ROUND(a, b, c, d, e, f, g, h, i) \
	do { \
		uint32		t1_ = (h) + BSIG1(e) + CH(e, f, g) + sha256_k[i] + w[i]; \
		uint32		ab_ = (a) ^ (b); \
		(d) += t1_; \
		(h) = t1_ + BSIG0(a) + ((ab_ & bc) ^ (b)); \
		bc = ab_; \
	} while (0)

/* Fold one 64-byte block into the state. */
static void
sha256_block(uint32 *state, const uint8 *block)
{
	uint32		w[64];
	uint32		a, b, c, d, e, f, g, h;
	uint32		bc;
	int			i;

	for (i = 0; i < 16; i++)
	{
		uint32		word;

		memcpy(&word, block + i * 4, sizeof(word));
		w[i] = pg_ntoh32(word);
	}
	for (i = 16; i < 64; i++)
		w[i] = w[i - 16] + SSIG0(w[i - 15]) + w[i - 7] + SSIG1(w[i - 2]);

	a = state[0];
	b = state[1];
	c = state[2];
	d = state[3];
	e = state[4];
	f = state[5];
	g = state[6];
	h = state[7];
	bc = b ^ c;
	for (i = 0; i < 64; i += 8)
	{
		ROUND(a, b, c, d, e, f, g, h, i);
		ROUND(h, a, b, c, d, e, f, g, i + 1);
		ROUND(g, h, a, b, c, d, e, f, i + 2);
		ROUND(f, g, h, a, b, c, d, e, i + 3);
		ROUND(e, f, g, h, a, b, c, d, i + 4);
		ROUND(d, e, f, g, h, a, b, c, i + 5);
		ROUND(c, d, e, f, g, h, a, b, i + 6);
		ROUND(b, c, d, e, f, g, h, a, i + 7);
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

#ifdef IDEM_SHA256_SHANI
/*
 * Fold one 64-byte block into the state with the SHA extensions.  They
 * keep the eight working variables in two registers, ABEF and CDGH (most
 * significant word first); each sha256rnds2 does two rounds, each group
 * of four message words is scheduled from the previous four groups with
 * sha256msg1 (the sigma0 part) and sha256msg2 (the sigma1 part).
 */
__attribute__((target("sha,sse4.1,ssse3")))
static void
sha256_block_shani(uint32 *state, const uint8 *block)
{
	const __m128i bswap = _mm_set_epi64x(0x0c0d0e0f08090a0bULL,
										 0x0405060700010203ULL);
	__m128i		dcba = _mm_loadu_si128((const __m128i *) &state[0]);
	__m128i		hgfe = _mm_loadu_si128((const __m128i *) &state[4]);
	__m128i		cdab = _mm_shuffle_epi32(dcba, 0xB1);
	__m128i		efgh = _mm_shuffle_epi32(hgfe, 0x1B);
	__m128i		abef = _mm_alignr_epi8(cdab, efgh, 8);
	__m128i		cdgh = _mm_blend_epi16(efgh, cdab, 0xF0);
	__m128i		abef_in = abef;
	__m128i		cdgh_in = cdgh;
	__m128i		w[4];
	int			i;

	for (i = 0; i < 16; i++)
	{
		__m128i		wk;

		if (i < 4)
			w[i] = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *) (block + i * 16)),
									bswap);
		else
		{
			/* W[t-16] + s0(W[t-15]) + W[t-7], then + s1(W[t-2]) */
			__m128i		x = _mm_sha256msg1_epu32(w[i & 3], w[(i + 1) & 3]);

			x = _mm_add_epi32(x, _mm_alignr_epi8(w[(i + 3) & 3], w[(i + 2) & 3], 4));
			w[i & 3] = _mm_sha256msg2_epu32(x, w[(i + 3) & 3]);
		}
		wk = _mm_add_epi32(w[i & 3],
						   _mm_loadu_si128((const __m128i *) &sha256_k[i * 4]));
		/*
		 * Two rounds make a new ABEF, and the old ABEF is the new CDGH; the
		 * next two rounds put both back in their variables.
		 */
		cdgh = _mm_sha256rnds2_epu32(cdgh, abef, wk);
		abef = _mm_sha256rnds2_epu32(abef, cdgh, _mm_shuffle_epi32(wk, 0x0E));
	}
	abef = _mm_add_epi32(abef, abef_in);
	cdgh = _mm_add_epi32(cdgh, cdgh_in);

	/* back to the state's order: A B C D, E F G H */
	{
		__m128i		feba = _mm_shuffle_epi32(abef, 0x1B);
		__m128i		dchg = _mm_shuffle_epi32(cdgh, 0xB1);

		_mm_storeu_si128((__m128i *) &state[0], _mm_blend_epi16(feba, dchg, 0xF0));
		_mm_storeu_si128((__m128i *) &state[4], _mm_alignr_epi8(dchg, feba, 8));
	}
}

/* Whether the processor has the SHA extensions and what they build on. */
static bool
cpu_has_sha(void)
{
	unsigned int eax, ebx, ecx, edx;

	if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx) ||
		!(ecx & bit_SSSE3) || !(ecx & bit_SSE4_1))
		return false;
	if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx))
		return false;
	return (ebx & bit_SHA) != 0;
}
#endif							/* IDEM_SHA256_SHANI */

typedef void (*sha256_block_fn) (uint32 *state, const uint8 *block);

/* The block function of this processor, chosen on first use. */
static sha256_block_fn
sha256_block_impl(void)
{
	static sha256_block_fn impl = NULL;

	if (unlikely(impl == NULL))
	{
		impl = sha256_block;
#ifdef IDEM_SHA256_SHANI
		if (cpu_has_sha())
			impl = sha256_block_shani;
#endif
	}
	return impl;
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
	sha256_block_fn block = sha256_block_impl();

	for (i = 0; i < full; i += 64)
		block(state, data + i);

	/* Last bytes, the 0x80 marker, zero padding and the bit length. */
	memset(tail, 0, tail_len);
	memcpy(tail, data + full, rest);
	tail[rest] = 0x80;
	for (i = 0; i < 8; i++)
		tail[tail_len - 1 - i] = (uint8) (bits >> (i * 8));
	block(state, tail);
	if (tail_len == 128)
		block(state, tail + 64);

	for (i = 0; i < 8; i++)
	{
		uint32		word = pg_hton32(state[i]);

		memcpy(out + i * 4, &word, sizeof(word));
	}
}
