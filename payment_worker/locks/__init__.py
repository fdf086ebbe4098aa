"""The account lock (Redis, owner-checked, watchdog-renewed) and its fencing tokens."""
