"""Room 7: rendering: terminal tables, JSON, the chain of reasoning (``render``) and the
Markdown report's plots (``plots``)."""
