-- Install the extension for the other regression tests.
CREATE EXTENSION idem;
SELECT extname, extversion FROM pg_extension WHERE extname = 'idem';
