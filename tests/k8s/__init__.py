"""Tests of the deployment: the Helm chart (helm/kvgate), manifests/, the dashboard."""
