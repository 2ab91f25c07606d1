-- What the documentation's examples take as given in each database, made
-- by test/docs.sh before a file's blocks run: the application's own table,
-- owned by the application role.  The roles app and ops are the
-- cluster's; the extension comes from the top-level README's Install
-- block.
CREATE TABLE stock (sku text PRIMARY KEY, qty integer NOT NULL);
INSERT INTO stock VALUES ('A', 100);
ALTER TABLE stock OWNER TO app;
