"""Adapters that plug tensorwire into serving engines. Each sits above the public API (``import tensorwire``) and
uses nothing else of tensorwire; importing ``tensorwire`` never imports one of them (nor the engine)."""
