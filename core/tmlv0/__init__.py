"""TMLv0, the chat format of tml-renderers 0.2.1 (``tml_renderers.v0.Renderer``), for every family that speaks it.

Inkling and Inkling-2 both use it (same special tokens and ids; docs/families/inkling2.md gives the
evidence), so it lives in the core and neither family imports the other:

- ``templates/tmlv0.jinja``: the chat template (``ChatTemplateSpec.template`` =
  ``"ferrule.tmlv0:templates/tmlv0.jinja"``), checked token for token against tml-renderers;
- :mod:`ferrule.tmlv0.tokenizer`: the tokenizer, built offline from the ``o200k_base`` ranks that
  tml-renderers ships (``ChatTemplateSpec.tokenizer`` = ``"ferrule.tmlv0.tokenizer:load_tmlv0_tokenizer"``);
- :mod:`ferrule.tmlv0.tool_calls`: the tool-invocation parser (``ToolParserSpec.parse`` =
  ``"ferrule.tmlv0.tool_calls:parse_tmlv0"``).

Importing this package imports nothing; the tokenizer imports transformers when it is built.
"""
