"""The layer every other builds on: errors, walking jaxprs, source lines, name scopes, a dot's axes, the compile policy
of shared programs, and the registries of platforms and backends."""
