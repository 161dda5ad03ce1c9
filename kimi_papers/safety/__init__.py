"""Safety papers: attacks on and defences of LLM guardrails."""
