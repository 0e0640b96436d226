"""Sample events and job specs (``shardfold invoke``, ``shardfold run``), shipped in the wheel as
``shardfold.events`` with the small data files they name (``data/``)."""
