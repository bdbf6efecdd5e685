"""ferrule's conformance kit: the checks every model family must pass, and the pytest classes that run them.

- :mod:`ferrule.conformance.kit`: the pytest plugin and :class:`~ferrule.conformance.kit.FamilyConformance`
  (a plugin package's test suite subclasses it; docs/plugins.md section 6);
- :mod:`ferrule.conformance.numeric`: the numeric checks on a tiny model (round trip, mapping coverage,
  rotary tables, translated fields, logits vs HF transformers, update-group coverage);
- :mod:`ferrule.conformance.fields`, :mod:`ferrule.conformance.media`, :mod:`ferrule.conformance.build`:
  translated fields as HF uses them, logits of a prompt with media through the towers, the cheap build
  check of ``ferrule plugins``;
- the worker programs the kit starts, each run with ``python -m``: :mod:`ferrule.conformance.tp1` (the
  TP=1 cases of a kit class's families in one fresh interpreter), :mod:`ferrule.conformance.tp` (the TP=2
  cases under ``torchrun``), :mod:`ferrule.conformance.check` (one numeric check in a fresh interpreter),
  :mod:`ferrule.conformance.discovery` (what plugin discovery imports).

Importing this package imports nothing (``ferrule check`` uses the numeric checks without pytest).
"""
