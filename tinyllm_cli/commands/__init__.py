"""The commands, one module each: ``generate``, ``serve_batch``, ``bench``, ``inspect_blocks``,
``plot``. Each is a thin client of ``LLM`` (``llm.py``) and shares its finishing code
(``common``). Only ``cli.py`` imports this package; nothing below it does.
"""
