"""Routing: which replica serves a request, from the fleet-wide prefix index and the replicas' loads."""
