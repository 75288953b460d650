"""Container tests: Stadium's image and the Podman launcher (conftest.py builds what they need)."""
