"""The soak tier: many runs through real workers while workers, Redis and Postgres are killed (``-m soak``)."""
