"""The ``getbatch`` job kind: many objects fetched into one ordered TAR (GetBatch, Aizman et al. 2026)."""
