"""Admission: who gets a session, and when.

:mod:`.doorway` is the one door every session comes through (the limits, the ids and tokens,
the count, decided once); :mod:`.slots` counts the server-wide slots and queues the waiting
sessions; :mod:`.fair` shares the slots between tenants; :mod:`.tenants` reads who the tenants
are; :mod:`.client_counts` keeps the per-client limits across worker processes.
"""
