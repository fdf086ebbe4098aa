"""The repository layer: tables, engine and every SQL statement of the service."""
