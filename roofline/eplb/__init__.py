"""Expert-parallel load balancing: the placement algorithm (algorithm.py) and the serving-time state that
counts expert loads over a sliding window and moves expert weights between ranks (state.py)."""
