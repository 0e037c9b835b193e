#include "tensor/storage.h"

namespace tessera {

StorageImpl::StorageImpl(int64_t nbytes, Device device)
    : nbytes_(nbytes), device_(device), allocator_(&allocator_for(device)) {
  data_ = allocator_->allocate(nbytes);
  tracker_ = MemoryScope::current();
  if (tracker_ != nullptr) tracker_->add(nbytes);
}

StorageImpl::StorageImpl(void* data, int64_t nbytes, Device device,
                         std::function<void(void*)> deleter)
    : data_(data), nbytes_(nbytes), device_(device), deleter_(std::move(deleter)) {}

StorageImpl::~StorageImpl() {
  if (allocator_ != nullptr) {
    allocator_->deallocate(data_, nbytes_);
    if (tracker_ != nullptr) tracker_->sub(nbytes_);
  } else if (deleter_) {
    deleter_(data_);
  }
}

}  // namespace tessera
