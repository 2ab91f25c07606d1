--
-- Last test: the keys the tests before wrote into the regression database
-- through idem's direct heap path (not the executor) each have their
-- primary key entry, and the index is sound (amcheck, with the heap check:
-- a row of the table missing from idem.keys_pkey fails here).
--
CREATE EXTENSION IF NOT EXISTS amcheck;
SELECT count(*) > 0 AS has_keys FROM idem.keys;
SELECT bt_index_check('idem.keys_pkey', true);
