/*-------------------------------------------------------------------------
 *
 * sha256.h
 *	  SHA-256, for the fingerprint digest.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEM_SHA256_H
#define IDEM_SHA256_H

extern void idem_sha256(const uint8 *data, size_t len, uint8 *out);

#endif							/* IDEM_SHA256_H */
