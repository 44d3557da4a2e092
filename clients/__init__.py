"""kvps_client: the asyncio client (and blocking wrapper) for kvps."""
