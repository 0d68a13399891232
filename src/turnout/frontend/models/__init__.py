"""Model lifecycle: discovery events become served models with their pipelines."""
