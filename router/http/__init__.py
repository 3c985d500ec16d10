"""The router's HTTP surface: app, handlers, request relay, upstream proxy."""
