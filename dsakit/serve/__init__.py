"""dsakit's OpenAI-compatible loopback servers, on one HTTP layer.

* :mod:`dsakit.serve.http`: the HTTP layer (routes, bounded bodies, admission with 503 + Retry-After,
  cancellation when a client goes away, streaming as events are made, injected faults for tests);
* :mod:`dsakit.serve.chat`: the chat template and the checks of a request's text;
* :mod:`dsakit.serve.service`: the request checks and response shapes every service shares;
* :mod:`dsakit.serve.limits`: the memory budget of ``dsakit serve`` and the limits derived from it;
* :mod:`dsakit.serve.model`: ``dsakit serve`` (a DeepSeek-V4 checkpoint on dsakit's blocks);
* :mod:`dsakit.serve.reference`: ``dsakit serve-reference`` (a retrieval procedure on dsakit's indexer, to
  test needle-in-a-haystack harnesses).

docs/serve.md and docs/niah.md.
"""
