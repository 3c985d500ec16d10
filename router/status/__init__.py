"""The fleet status: its model (pure), what the router remembers for it, the web page."""
