/* idem--1.1--1.2.sql */

-- complain if script is sourced in psql, rather than via ALTER EXTENSION
\echo Use "ALTER EXTENSION idem UPDATE TO '1.2'" to load this file. \quit

/*
 * 1.2: the primary key leads with the key, and the extension's objects are
 * owner-only whatever default privileges the installing role has.
 *
 * Every name below is schema-qualified, so what this script does does not
 * depend on the search_path it runs with.
 */

/*
 * Privileges.  ALTER DEFAULT PRIVILEGES of the role that runs CREATE
 * EXTENSION apply to the objects the scripts create (a GRANT SELECT ON
 * TABLES to a reporting role would let it read stored bodies).  Nobody but
 * the owner is ever meant to have a privilege on the schema idem, its key
 * table or its token sequence: revoke whatever is there.  In a fresh
 * install (the schema was created by this same transaction) no
 * administrator has granted anything yet, so the functions and views are
 * reset to the owner alone as well; in an update, grants made to
 * application and operator roles stay (README, "Security").
 */
DO $$
DECLARE
	fresh boolean;
	r record;
BEGIN
	SELECT pg_catalog.age(n.xmin) OPERATOR(pg_catalog.=) 0 INTO fresh
	  FROM pg_catalog.pg_namespace n
	 WHERE n.nspname OPERATOR(pg_catalog.=) 'idem';
	FOR r IN
		SELECT CASE
				   WHEN d.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_namespace'::pg_catalog.regclass
				   THEN pg_catalog.format('SCHEMA %I', n.nspname)
				   WHEN d.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_proc'::pg_catalog.regclass
				   THEN pg_catalog.format('FUNCTION %s', d.objid::pg_catalog.regprocedure)
				   WHEN c.relkind OPERATOR(pg_catalog.=) 'S'
				   THEN pg_catalog.format('SEQUENCE %s', d.objid::pg_catalog.regclass)
				   ELSE pg_catalog.format('TABLE %s', d.objid::pg_catalog.regclass)
			   END AS object,
			   CASE WHEN a.grantee OPERATOR(pg_catalog.=) 0 THEN 'PUBLIC'
					ELSE pg_catalog.quote_ident(a.grantee::pg_catalog.regrole::pg_catalog.text)
			   END AS grantee
		  FROM pg_catalog.pg_depend d
		  JOIN pg_catalog.pg_extension e ON e.oid OPERATOR(pg_catalog.=) d.refobjid
		  LEFT JOIN pg_catalog.pg_namespace n
				 ON d.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_namespace'::pg_catalog.regclass
				AND n.oid OPERATOR(pg_catalog.=) d.objid
		  LEFT JOIN pg_catalog.pg_class c
				 ON d.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_class'::pg_catalog.regclass
				AND c.oid OPERATOR(pg_catalog.=) d.objid
		  LEFT JOIN pg_catalog.pg_proc p
				 ON d.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_proc'::pg_catalog.regclass
				AND p.oid OPERATOR(pg_catalog.=) d.objid
		 CROSS JOIN LATERAL pg_catalog.aclexplode(
				COALESCE(n.nspacl, c.relacl, p.proacl)) a
		 WHERE e.extname OPERATOR(pg_catalog.=) 'idem'
		   AND d.deptype OPERATOR(pg_catalog.=) 'e'
		   AND a.grantee OPERATOR(pg_catalog.<>)
			   COALESCE(n.nspowner, c.relowner, p.proowner)
		   AND (fresh
				OR n.nspname OPERATOR(pg_catalog.=) 'idem'
				OR d.objid OPERATOR(pg_catalog.=) 'idem.keys'::pg_catalog.regclass
				OR d.objid OPERATOR(pg_catalog.=) 'idem.token_seq'::pg_catalog.regclass)
		 GROUP BY 1, 2
	LOOP
		EXECUTE pg_catalog.format('REVOKE ALL ON %s FROM %s CASCADE', r.object, r.grantee);
	END LOOP;
END
$$;

/*
 * The primary key on (key, scope) instead of (scope, key).  Most
 * applications use one scope, so a lookup compared two equal scopes at
 * every step of the descent before reaching the key; leading with the key
 * settles most steps with one comparison.  Rebuilding the index takes an
 * exclusive lock on idem.keys for as long as the build takes.
 */
ALTER TABLE idem.keys DROP CONSTRAINT keys_pkey;
ALTER TABLE idem.keys ADD CONSTRAINT keys_pkey PRIMARY KEY (key, scope);
