"""send"""
