"""What a user installs: the built sdist and wheel in a fresh venv (`make release`)."""
