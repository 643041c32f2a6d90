"""Needle-in-a-haystack sweeps against OpenAI-compatible servers, and a reference server to test them.

* :func:`dsakit.niah.sweep.run_sweep` (CLI ``dsakit niah``): context length x depth grid, distinct filler,
  exact lengths (local tokenizer or calibration from ``usage.prompt_tokens``), robust async running,
  append-only JSONL with resume, per-cell lines, summary table and heatmap.
* ``dsakit serve-reference`` (:mod:`dsakit.niah.server`): an OpenAI-compatible loopback server whose
  "model" is a transparent retrieval procedure built on dsakit's indexer (:mod:`dsakit.niah.retrieval`),
  not a language model. Its answers depend on the index-key format and top-k.

See docs/niah.md.
"""
