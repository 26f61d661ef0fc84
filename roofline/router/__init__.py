"""`roofline router`: an OpenAI-compatible proxy in front of several engines.

  backends.py  the engines behind the router, their health and load, the health-check loop
  policies.py  which replica serves a request: round_robin, least_load, prefix_aware
  app.py       the FastAPI app: prefill/decode disaggregation (PD) and data-parallel replicas,
               streaming passed through, the router's own /health and /metrics
"""
