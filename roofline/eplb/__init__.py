"""Expert-parallel load balancing: the placement algorithm (algorithm.py).  The serving-time state that
counts expert loads over a sliding window and moves expert weights between ranks lives with the MoE
layers it rebalances (model_executor/layers/moe/eplb_state.py)."""
