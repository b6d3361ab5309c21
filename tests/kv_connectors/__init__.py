"""KV connectors defined outside the build, for tests: each is loaded by its
`kv_connector_module_path`, as a user's own connector would be."""
