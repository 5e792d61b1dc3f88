"""Reversible rewriting of a model's source: the one model-surgery pipeline of speedkit.

``source`` reads, parses (once), compiles and binds methods, and says whose code is the user's;
``ast_tools`` holds the AST helpers the matchers share; ``pipeline`` runs find → decide → emit →
compile → bind over one plan and reports it; ``attention`` / ``attention_emit`` (sdpa), ``gemms``
(batched) and ``layers`` (triton_layers) are the rungs' matchers and emitters.
"""
