"""kvbridge vLLM KV connector (loaded with kv_connector_module_path)."""
