"""receive"""
