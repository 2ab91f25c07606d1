package idempotency

import (
	"errors"

	"github.com/jackc/pgconn"
)

var ErrUnavailable = errors.New("idempotency store unavailable")

// Errors of idem's SQLSTATEs.  The server's errors are *Error values that
// match these with errors.Is (and *pgconn.PgError with errors.As);
// MemoryStore returns them as they are.
var (
	// ErrFingerprintMismatch (ID001): a complete with a fingerprint other
	// than the claim's.
	ErrFingerprintMismatch = errors.New("idempotency key completed with another fingerprint than its claim's")
	// ErrSuperseded (ID002): another caller took the key over after the
	// lease; this claim's token is stale.
	ErrSuperseded = errors.New("idempotency claim superseded by a takeover")
	// ErrNoClaim (ID003): the key has no live claim (missing or expired,
	// or no token outside the claiming transaction).
	ErrNoClaim = errors.New("idempotency key has no live claim")
	// ErrAlreadyCompleted (ID004): the key is completed already (with
	// another response, or a release or extend after completion).
	ErrAlreadyCompleted = errors.New("idempotency key already completed")
)

// Error is an error idem raised, with its SQLSTATE.
type Error struct {
	Code    string // SQLSTATE: ID001, ID002, ID003 or ID004
	Message string
	Err     *pgconn.PgError
}

func (e *Error) Error() string {
	return "idem: " + e.Message + " (SQLSTATE " + e.Code + ")"
}

// Unwrap returns the server's error.
func (e *Error) Unwrap() error { return e.Err }

// Is matches the sentinel of the SQLSTATE.  ID001 and ID003 also match
// ErrConflict, which MemoryStore.Complete returns for a key with another
// fingerprint or no record.
func (e *Error) Is(target error) bool {
	switch target {
	case ErrFingerprintMismatch:
		return e.Code == "ID001"
	case ErrSuperseded:
		return e.Code == "ID002"
	case ErrNoClaim:
		return e.Code == "ID003"
	case ErrAlreadyCompleted:
		return e.Code == "ID004"
	case ErrConflict:
		return e.Code == "ID001" || e.Code == "ID003"
	}
	return false
}

// mapError turns idem's SQLSTATEs into *Error and leaves other errors alone.
func mapError(err error) error {
	var pg *pgconn.PgError
	if err == nil || !errors.As(err, &pg) {
		return err
	}
	switch pg.Code {
	case "ID001", "ID002", "ID003", "ID004":
		return &Error{Code: pg.Code, Message: pg.Message, Err: pg}
	}
	return err
}
