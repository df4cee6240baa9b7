"""The HTTP API: :func:`create_app` builds the FastAPI application."""

from service.api.app import create_app

__all__ = ["create_app"]
