"""``pcgspec train-eagle3``: an EAGLE3 head trained on the target's own responses.

prompts (``prompts.py``; everyday requests in ``chat_requests.py``, ``request_words.py``; topics
in ``topics.py``) -> generate + capture through the engine (``generate.py``) -> shards
(``data.py``) -> the head unrolled with training-time test (``model.py``, ``loss.py``) in
``trainer.py`` -> the published layout. ``options.py`` and ``pipeline.py`` hold the command.
Nothing here imports torch at package import.
"""
