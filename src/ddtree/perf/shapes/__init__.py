"""Room 2: model shapes (``ModelShape``), presets and the ``config.json`` readers."""
