"""The dtype auditor: `audit_dtypes` / `assert_dtypes`, reading a jaxpr for where a
computation leaves `p.dtype`. Imports only the core."""
