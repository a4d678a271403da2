-- 0004_instance_provisioners: each daemon says which provisioner ids it serves, so a request
-- for an id that no running daemon serves can be refused at once instead of failing later.
-- NULL: a daemon that does not say (one started before this column existed).
ALTER TABLE hubd_instances ADD COLUMN provisioners text[];
