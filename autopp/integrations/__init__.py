"""Integrations of autopp with training frameworks (imported only on demand)."""
