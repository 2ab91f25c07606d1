-- The database the client suites run in a second time: what their SQL must
-- not depend on.  SQL_ASCII (psycopg returns text as bytes there), and the
-- session settings that change how values are written as text: dates in
-- the SQL style, day first, in a zone with a 45-minute offset; intervals
-- in the SQL standard's style; bytea in the escape format; float8 rounded
-- to 2 digits; backslashes in string literals as escapes.
--
--   psql -X -v ON_ERROR_STOP=1 -d postgres -f test/odd_database.sql
CREATE DATABASE idem_odd TEMPLATE template0 ENCODING 'SQL_ASCII' LOCALE 'C';
ALTER DATABASE idem_odd SET DateStyle = 'SQL, DMY';
ALTER DATABASE idem_odd SET TimeZone = 'Asia/Kathmandu';
ALTER DATABASE idem_odd SET IntervalStyle = 'sql_standard';
ALTER DATABASE idem_odd SET bytea_output = 'escape';
ALTER DATABASE idem_odd SET extra_float_digits = -15;
ALTER DATABASE idem_odd SET standard_conforming_strings = off;
\connect idem_odd
CREATE EXTENSION idem;
