"""Text helpers (a SWE task for Stadium's ``swe`` env)."""
