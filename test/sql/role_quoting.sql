--
-- Role names that need quoting, in the privileges the install and update
-- scripts revoke and grant again (doc/security.md): "Reporting" (mixed
-- case) and """Reporting""", a role whose name holds the quote characters
-- that a name quoted twice would point at.  Each must get what was meant
-- for it and nothing meant for the other.  Installs the extension again in
-- this database and leaves it at the default version, as setup.sql did.
--
CREATE ROLE "Reporting";
-- Privileges of a role, by OID, on the objects a reporting role must not
-- reach and on idem_stats, which is granted to operators.
CREATE FUNCTION role_privileges(role_name name,
	OUT schema_usage boolean, OUT keys_select boolean, OUT seq_usage boolean,
	OUT may_begin boolean, OUT stats_execute boolean,
	OUT stats_execute_grantable boolean, OUT stats_select boolean)
LANGUAGE sql AS $$
	SELECT has_schema_privilege(r.oid, 'idem', 'USAGE'),
		   has_table_privilege(r.oid, 'idem.keys', 'SELECT'),
		   has_sequence_privilege(r.oid, 'idem.token_seq', 'USAGE'),
		   has_function_privilege(r.oid, (SELECT p.oid FROM pg_proc p WHERE p.proname = 'idem_begin'),
								  'EXECUTE'),
		   has_function_privilege(r.oid, 'idem_stats()', 'EXECUTE'),
		   has_function_privilege(r.oid, 'idem_stats()', 'EXECUTE WITH GRANT OPTION'),
		   has_table_privilege(r.oid, 'idem_stats', 'SELECT')
	  FROM pg_roles r WHERE r.rolname = role_name
$$;

-- Default privileges of the role that installs the extension, as a
-- reporting set-up has them.
ALTER DEFAULT PRIVILEGES GRANT USAGE ON SCHEMAS TO "Reporting";
ALTER DEFAULT PRIVILEGES GRANT SELECT ON TABLES TO "Reporting";
ALTER DEFAULT PRIVILEGES GRANT USAGE, SELECT ON SEQUENCES TO "Reporting";
ALTER DEFAULT PRIVILEGES GRANT EXECUTE ON FUNCTIONS TO "Reporting";
SELECT d.defaclobjtype, a.grantee::regrole AS grantee, a.privilege_type
  FROM pg_default_acl d, aclexplode(d.defaclacl) a
 WHERE d.defaclrole = current_user::regrole AND a.grantee NOT IN (0, d.defaclrole)
 ORDER BY 1, 3;

-- A fresh install revokes them from "Reporting": none of its objects is
-- shared.
DROP EXTENSION idem;
CREATE EXTENSION idem;
SELECT extversion FROM pg_extension WHERE extname = 'idem';
SELECT * FROM role_privileges('Reporting');

-- The same with a role named "Reporting", quotes included: the privileges
-- are revoked from Reporting, and the other role gets none.
CREATE ROLE """Reporting""";
SELECT rolname FROM pg_roles WHERE rolname LIKE '%Reporting%' ORDER BY 1;
DROP EXTENSION idem;
CREATE EXTENSION idem;
SELECT extversion FROM pg_extension WHERE extname = 'idem';
SELECT * FROM role_privileges('Reporting');
SELECT * FROM role_privileges('"Reporting"');

-- An update from 1.1 installed under those defaults: Reporting loses what
-- it had on the schema, the key table and the token sequence; it keeps
-- the functions and views, whose grants administrators make on purpose.
-- The quote-named role gets nothing.
DROP EXTENSION idem;
CREATE EXTENSION idem VERSION '1.1';
SELECT * FROM role_privileges('Reporting');
ALTER EXTENSION idem UPDATE;
SELECT extversion FROM pg_extension WHERE extname = 'idem';
SELECT * FROM role_privileges('Reporting');
SELECT * FROM role_privileges('"Reporting"');

-- The update to 1.3 creates idem_stats() and its view again and grants
-- them again to whoever had them: "Reporting", with the grant option on
-- the function, not the quote-named role.  No default privileges this
-- time, so that what Reporting has comes from the update alone.
ALTER DEFAULT PRIVILEGES REVOKE USAGE ON SCHEMAS FROM "Reporting";
ALTER DEFAULT PRIVILEGES REVOKE SELECT ON TABLES FROM "Reporting";
ALTER DEFAULT PRIVILEGES REVOKE USAGE, SELECT ON SEQUENCES FROM "Reporting";
ALTER DEFAULT PRIVILEGES REVOKE EXECUTE ON FUNCTIONS FROM "Reporting";
SELECT count(*) AS default_acls FROM pg_default_acl WHERE defaclrole = current_user::regrole;
DROP EXTENSION idem;
CREATE EXTENSION idem VERSION '1.2';
GRANT EXECUTE ON FUNCTION idem_stats() TO "Reporting" WITH GRANT OPTION;
GRANT SELECT ON idem_stats TO "Reporting";
SELECT * FROM role_privileges('Reporting');
ALTER EXTENSION idem UPDATE TO '1.3';
SELECT extversion FROM pg_extension WHERE extname = 'idem';
SELECT * FROM role_privileges('Reporting');
SELECT * FROM role_privileges('"Reporting"');
-- The view is the new one, and Reporting reads it.
SET ROLE "Reporting";
SELECT count(purge_start_failures) = count(*) AS reporting_reads_stats FROM idem_stats;
RESET ROLE;

-- Back to a fresh install at the default version, for the later tests.
DROP EXTENSION idem;
CREATE EXTENSION idem;
SELECT extversion FROM pg_extension WHERE extname = 'idem';
DROP FUNCTION role_privileges(name);
DROP ROLE "Reporting", """Reporting""";
