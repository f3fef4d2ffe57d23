"""Model implementations loaded from local Hugging Face directories."""
