"""xdc.scheduler"""
