package idempotency

import (
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgconn"
)

var ErrUnavailable = errors.New("idempotency store unavailable")

// unavailableError is Do's error when no claim could be made: it matches
// ErrUnavailable and carries the store's error.
type unavailableError struct{ err error }

func (e *unavailableError) Error() string        { return ErrUnavailable.Error() + ": " + e.err.Error() }
func (e *unavailableError) Is(target error) bool { return target == ErrUnavailable }
func (e *unavailableError) Unwrap() error        { return e.err }

// unavailable wraps a failed claim's error so that it matches
// ErrUnavailable; the store's error stays reachable with errors.As.
func unavailable(err error) error { return &unavailableError{err: err} }

// ErrNotStored matches the error of a Do whose handler ran but whose
// response the store refused for good: NotStoredResponse is stored in its
// place (see NotStoredError).
var ErrNotStored = errors.New("idempotency response not stored")

// NotStoredStatus and NotStoredBody make the answer stored in place of a
// response that could not be stored, and replayed to every retry: the
// server's answer to a body larger than idem.max_body_size, with this
// detail (doc/http.md).
const (
	NotStoredStatus = 500
	NotStoredBody   = `{"type":"about:blank","title":"Response not stored","status":500,` +
		`"detail":"The response to the first request with this key could not be stored; it was sent then and is not replayed."}`
)

// NotStoredResponse is the answer stored in place of a response that
// could not be stored.
func NotStoredResponse() Response {
	return Response{Status: NotStoredStatus, Body: []byte(NotStoredBody)}
}

// NotStoredError is Do's error when the handler ran but the store refused
// its response for a reason that a retry of the same complete cannot fix
// (a data error, say): NotStoredResponse was stored in its place, so the
// key is done and a retry replays the 500 instead of running the handler
// again.  It matches ErrNotStored; Err is the refused complete's error.
type NotStoredError struct {
	Key string
	Err error
}

func (e *NotStoredError) Error() string {
	return fmt.Sprintf("idempotency: response to key %q not stored (%v); %d %q stored in its place",
		e.Key, e.Err, NotStoredStatus, "Response not stored")
}

func (e *NotStoredError) Is(target error) bool { return target == ErrNotStored }

// Unwrap returns the refused complete's error.
func (e *NotStoredError) Unwrap() error { return e.Err }

// notStorable tells whether a failed Complete refused the response for
// good, so that Do stores NotStoredResponse in its place.  It does not for
// an error without a SQLSTATE (a lost connection, a timeout, a fault hook,
// MemoryStore's errors), a connection failure (class 08), a serialization
// failure or deadlock (40001, 40P01), a lock or statement timeout or
// cancel (55P03, 57014), a shutdown (57P01 to 57P03) or a lack of
// resources (class 53), after which the same complete may succeed, nor
// for a key that is no longer this claim's (ID002, ID003, 42501) or is
// completed already (ID004).
func notStorable(err error) bool {
	var pg *pgconn.PgError
	if !errors.As(err, &pg) {
		return false
	}
	switch {
	case strings.HasPrefix(pg.Code, "08"), strings.HasPrefix(pg.Code, "53"):
		return false
	}
	switch pg.Code {
	case "40001", "40P01", "55P03", "57014", "57P01", "57P02", "57P03",
		"ID002", "ID003", "ID004", "42501":
		return false
	}
	return true
}

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
	Code    string // SQLSTATE: ID001, ID002, ID003, ID004; 42883 or 3F000 for a missing function or schema
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

// missingError turns a missing function (42883) or schema (3F000) into
// *Error naming the function and schema looked for and what fixes it (the
// Schema option, or an update of an old version); other errors are
// mapError's.  schema is quoted; fn is the function with its argument
// types.
func missingError(err error, schema, fn string) error {
	var pg *pgconn.PgError
	if err == nil || !errors.As(err, &pg) || (pg.Code != "42883" && pg.Code != "3F000") {
		return mapError(err)
	}
	name := fn
	if i := strings.IndexByte(fn, '('); i >= 0 {
		name = fn[:i]
	}
	if strings.HasPrefix(fn, "idem_begin(") && strings.Count(fn, ",") == 6 {
		name += " with wait_for"
	}
	msg := fmt.Sprintf("%s not found in schema %s (%s: %s.%s: %s); "+
		"set PostgresStore.Schema to the schema where CREATE EXTENSION idem put it, "+
		"or if the version is old run ALTER EXTENSION idem UPDATE",
		name, schema, pg.Code, schema, fn, pg.Message)
	return &Error{Code: pg.Code, Message: msg, Err: pg}
}
