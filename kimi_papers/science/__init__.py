"""Science papers: causal inference, privacy, search heuristics."""
