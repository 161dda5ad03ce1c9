"""Paper modules on LLM agents and games."""
