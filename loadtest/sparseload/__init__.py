"""Pure-Python pieces of the sgl-sparse load test (no locust import).

Kept apart from ``loadtest/locustfile.py`` so that they can be unit-tested in an
environment without locust/gevent (tests/test_loadtest.py) and reused by other
clients: the policy mix and scenario specs (``mix``), prompt generation with
token-length control (``prompts``), request bodies and stream parsing for the three
SGLang endpoints (``sse``), and the per-policy aggregation, thresholds and summary
(``results``).
"""
