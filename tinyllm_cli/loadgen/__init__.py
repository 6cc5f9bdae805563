"""The load generator: open-loop arrivals sent to any OpenAI-compatible server over HTTP, what
each request experienced from the client's side, and per-rate summaries with goodput.

A client of the HTTP API only: nothing here imports the engine, the cache, the model, the
runtime, ``llm``, ``cluster`` or ``sim`` (tests/test_structure.py checks it), so it measures
tinyllm's server and anyone else's the same way.

    schedule.py   seeded send times (Poisson, gamma, all at once, a trace) and their prompts
    client.py     one streamed request -> one ``RequestRecord``
    records.py    the record, percentiles, goodput and the per-rate summary
    metrics.py    the server's Prometheus /metrics: scraped before, during and after a run
    run.py        the open-loop dispatcher for one rate
"""
